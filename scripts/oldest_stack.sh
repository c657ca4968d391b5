#!/usr/bin/env bash
# Sourced by test.sh: an overlay with the oldest supported stack, TensorRT-LLM 1.2.1's pins (transformers 4.57.3,
# numpy 1.26), over the project's environment. Sets OLDEST_PYTHONPATH (empty when it cannot be made here).
#
# The overlay holds only the packages that differ (transformers and the tokenizers / huggingface-hub releases
# it accepts, numpy); with PYTHONPATH=$OLDEST_PYTHONPATH they shadow the environment's own, and everything
# else (torch, safetensors, ...) is shared. Made once; a second run takes no time (stamp file).
OLDEST_PINS=(transformers==4.57.3 tokenizers==0.22.1 huggingface-hub==0.36.0)
# numpy 1.26 has wheels up to Python 3.12; a newer Python keeps the environment's numpy.
if "$PY" -c "import sys; sys.exit(sys.version_info < (3, 13))"; then :; else OLDEST_PINS+=(numpy==1.26.4); fi
OLDEST_DIR=${OLDEST_DIR:-.venv-oldest}
OLDEST_PYTHONPATH=""
want=$(printf '%s\n' "${OLDEST_PINS[@]}")
if [ -f "$OLDEST_DIR/.stamp" ] && [ "$(cat "$OLDEST_DIR/.stamp")" = "$want" ]; then
  OLDEST_PYTHONPATH=$PWD/$OLDEST_DIR
elif rm -rf "$OLDEST_DIR" && "$PY" -m pip install --quiet --no-deps --target "$OLDEST_DIR" "${OLDEST_PINS[@]}"; then
  echo "$want" > "$OLDEST_DIR/.stamp"
  OLDEST_PYTHONPATH=$PWD/$OLDEST_DIR
else
  echo "oldest stack: could not install ${OLDEST_PINS[*]} (offline?)" >&2
fi
