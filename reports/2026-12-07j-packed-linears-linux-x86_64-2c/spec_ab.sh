#!/bin/bash
# $1 = on|off, rest: bench spec args
mode=$1; shift
.venv/bin/python -c "
import sys
import specula.targets.packed_linear as p
if '$mode' == 'off': p.AUTO_MAX_BYTES = 0
from specula.cli import main
sys.exit(main(sys.argv[1:]))
" bench spec "$@"
