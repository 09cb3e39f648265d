"""Sampling constants both sides agree on: greedy's threshold and the logprobs' temperature."""

from __future__ import annotations

#: SGLang treats ``0 <= temperature < GREEDY_EPS`` as greedy (``_SAMPLING_EPS``).
GREEDY_EPS = 1e-6


def logprob_temperature(temperature: float, *, return_original_logprob: bool = False) -> float:
    """The temperature ``T_lp`` of the logprobs SGLang returns for a request sampled at ``T``.

    ``output_token_logprobs[i] = log_softmax(z_i / T_lp)[token_i]`` over the full vocabulary,
    where ``z_i`` are the logits after penalties / bias / ``min_new_tokens`` suppression and
    before top-k / top-p / min-p filtering (no renormalisation). ``T_lp = T``, except: greedy
    requests (``T < 1e-6``, which SGLang turns into ``T = 1, top_k = 1``) and servers started
    with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` (``--return-original-logprob`` on the embedded
    server) report ``T_lp = 1``. Prompt logprobs (``input_token_logprobs``) are always at 1.
    Source: SGLang 0.5.23 ``python/sglang/srt/layers/sampler.py`` ``Sampler.forward`` and
    ``sampling/sampling_params.py`` ``SamplingParams.__post_init__``.

    >>> logprob_temperature(0.6), logprob_temperature(0.0)
    (0.6, 1.0)
    >>> logprob_temperature(0.6, return_original_logprob=True)
    1.0
    """
    if temperature < GREEDY_EPS or return_original_logprob:
        return 1.0
    return float(temperature)
