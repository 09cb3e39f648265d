"""``python -m osworld_jax.env.cache {fetch,status} TASKS_DIR --cache-dir DIR``."""

import sys

from osworld_jax.env.cache.fetch import main

try:
    sys.exit(main())
except KeyboardInterrupt:  # downloads in flight keep their .part files for the next run
    sys.exit(130)
