"""Put this folder on PYTHONPATH (bench/sglang_live.sh does) so that every Python process of a live
SGLang run, SGLang's spawned scheduler and detokenizer included, installs the sgl_kernel shim before
it imports SGLang. Only with WS_SGL_KERNEL_SHIM=1: the folder on the path alone changes nothing."""

import os

if os.environ.get("WS_SGL_KERNEL_SHIM") == "1":
    from tests.support.sgl_kernel_shim import install

    install()
