"""Specula on Ray Serve: the deployments, the builder, the CLI, and the engines they wrap.

Public surface::

    from specula.runtime.serve import build_app, LocalApp, VerifierEngine, VisionEngine, IngressEngine
    serve.run(build_app(load_config("specula.yaml")))      # Ray Serve (builder.py, the only .bind)
    LocalApp.from_config(cfg).generate({...})              # the same engines in one process, no Ray

The engines (vision.py, verifier.py, ingress.py, ../dataplane/) never import Ray; deployments.py, builder.py and
launch.py do, and are imported lazily here so that in-process users never pay for Ray.
"""

from __future__ import annotations

# everything is imported on first use: `specula --help` and the CLI parser must not pay for torch or Ray
_LAZY = {"build_app": "builder", "app_builder": "builder", "serve_cli": "launch", "add_serve_arguments": "launch",
         "GenerateBody": "ingress", "IngressEngine": "ingress", "RequestError": "ingress", "LocalApp": "local",
         "VerifierEngine": "verifier", "VerifierError": "verifier", "VisionEngine": "vision"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"specula.runtime.serve.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'specula.runtime.serve' has no attribute {name!r}")


__all__ = ["GenerateBody", "IngressEngine", "LocalApp", "RequestError", "VerifierEngine", "VerifierError",
           "VisionEngine", *_LAZY]
