# Sourced by setup.sh, demo.sh and test.sh: decide which Python the project runs with, into $PY.
#
#   PYTHON=/path/to/python   that interpreter, as it is (the user's own choice; nothing is created)
#   an active virtualenv     its python ($VIRTUAL_ENV/bin/python)
#   otherwise                the project's own venv, .venv/ (setup.sh creates it), so that Debian's or
#                            Ubuntu's externally-managed system Python (PEP 668) works like any other
# After setup, use the venv with `source .venv/bin/activate` or call `.venv/bin/python` directly.
PROJECT_VENV=${PROJECT_VENV:-.venv}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
  PY_ORIGIN="PYTHON=$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY=$VIRTUAL_ENV/bin/python
  PY_ORIGIN="the active virtualenv $VIRTUAL_ENV"
else
  PY=$PROJECT_VENV/bin/python
  PY_ORIGIN="the project venv $PROJECT_VENV"
fi
