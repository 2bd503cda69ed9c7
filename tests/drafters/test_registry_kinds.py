"""``registry.kinds()`` names every built-in drafter without importing one (the runtime config checks a drafter
``kind`` with it at load time), and its list of built-ins is exactly what loading them registers."""

from __future__ import annotations

import subprocess
import sys


def test_builtin_kinds_are_the_ones_their_modules_register():
    from specula.drafters import registry
    from specula.drafters.registration import REGISTERED

    registry._load_builtin()
    builtin = {kind: cls for kind, cls in REGISTERED.items() if cls.__module__.startswith("specula.drafters.")}
    assert set(builtin) == set(registry.BUILTIN)
    for kind, cls in builtin.items():
        assert cls.__module__ == f"specula.drafters.{registry.BUILTIN[kind]}", kind
    assert set(registry.BUILTIN) <= set(registry.kinds())


def test_kinds_imports_no_drafter_module():
    code = ("import sys\nfrom specula.drafters.registry import BUILTIN, kinds\nassert 'ngram' in kinds()\n"
            "print(sorted(m for m in set(BUILTIN.values()) if f'specula.drafters.{m}' in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
