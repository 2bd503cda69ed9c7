# Sourced by the device scripts (R = the checkout): sets SPECULA, the command that runs the `specula` CLI. With
# SPECULA_LAYOUT=1 (a machine that cannot `pip install -e .`: no registry) it builds a package layout of the checkout
# under /tmp and installs a transformers wheel of the pinned range from gpu/, if one was put there.
if [ "${SPECULA_LAYOUT:-0}" = 1 ]; then
  for w in "$R"/gpu/transformers-*.whl; do
    [ -f "$w" ] && python3 -m pip install --no-deps --no-index -q --target /tmp/specula-tf "$w"
  done
  mkdir -p /tmp/specula-pk/specula && cp -r "$R"/specula/. /tmp/specula-pk/specula/
  for d in runtime targets drafters world zoo protos; do ln -sfn "$R/$d" "/tmp/specula-pk/specula/$d"; done
  export PYTHONPATH=/tmp/specula-pk:/tmp/specula-tf
  SPECULA=(python3 -c "import sys; from specula.cli import main; sys.exit(main(sys.argv[1:]))")
else
  SPECULA=(specula)
fi
