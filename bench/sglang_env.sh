# Sourced by bench/sglang_live.sh and bench/sglang_rl_cli.sh: the GPU host's environment for SGLang 0.5.10.
# Installs SGLang's wheels ($WS_SGLANG_WHL: sglang + its light deps) and the services' (.whl/, or ../../.whl/ from a
# helper's copy under .gpu/) --no-deps into /tmp/site, and loads the sgl_kernel shim (tests/support/sgl_kernel_shim.py)
# in every process through sitecustomize: sgl_kernel and flashinfer cannot be installed on these hosts.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WS_SGLANG_WHL=${WS_SGLANG_WHL:?set WS_SGLANG_WHL to the folder of SGLang wheels}
WHEELS=("$WS_SGLANG_WHL"/*.whl)
[ -d ../../.whl ] && WHEELS+=(../../.whl/*.whl)
[ -d .whl ] && WHEELS+=(.whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS[@]}" \
  || { echo "installing wheels failed" >&2; exit 2; }
export PYTHONPATH=$PWD/tests/support/sglang_gpu_site:$PWD:/tmp/site WS_SGL_KERNEL_SHIM=1
