# Sourced by the deploy/ scripts: pick the Python to use and how pip installs.
#   $PY        the interpreter: $VIRTUAL_ENV's, else the project's .venv, else python3
#   pip_install PKG...   installs into that venv, or with --user when there is none
#   $SCRIPTS   where console scripts of installed packages land
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY="$VIRTUAL_ENV/bin/python"; PIP_USER=""
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"; PIP_USER=""
else
  PY="${PYTHON:-python3}"; PIP_USER="--user"
fi
if [ -n "$PIP_USER" ]; then
  SCRIPTS="$("$PY" -c 'import os, sysconfig; print(sysconfig.get_path("scripts", os.name + "_user"))')"
else
  SCRIPTS="$(dirname "$PY")"
fi
pip_install() {
  "$PY" -m pip install -q --disable-pip-version-check --no-warn-script-location $PIP_USER "$@"
}
# A Debian-managed python3 refuses user installs without this flag (PEP 668).
if [ -n "$PIP_USER" ] && "$PY" -c 'import os, sys, sysconfig; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)'; then
  PIP_USER="--user --break-system-packages"
fi
