"""``python -m osworld_jax.env {report,runnable} DIR``: which tasks a backend can run here.

See ``osworld_jax.env.capabilities.main``.
"""

import sys

from osworld_jax.env.capabilities import main

sys.exit(main())
