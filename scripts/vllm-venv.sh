# Sourced by setup-vllm.sh and setup-vllm-cpu.sh: the venv helpers both vLLM environments are built with.
# Needs VENV and PY set; makes the venv if it is missing.
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip -q "$@"; }
installed() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }

# install_without_deps DIST VERSION: the wheel alone (pip must never resolve vLLM's own dependency set).
install_without_deps() {
  installed "$1" "$2" && return 0
  local wheels
  wheels=$(mktemp -d)
  pip download --no-deps --dest "$wheels" "$1==$2"
  pip install --no-deps "$wheels"/"${1//-/_}"-"$2"-*.whl
  rm -rf "$wheels"
}
