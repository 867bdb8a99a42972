# Sourced by the lab's device-call scripts after they set PYTHONPATH: $OUT made, everything after this tee'd to
# $OUT/$1, `step` prints the seconds since the start before each stage, and the device and versions are printed.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/$1") 2>&1
started=$SECONDS
step() { echo "== $(( SECONDS - started )) s: $*"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
echo "tree: ${TREE_COMMIT:-unknown} (the device copy's .git may be older than its working tree)"
