"""``specula serve``: the distributed runtime on Ray Serve. The flags and the work live in runtime/serve/launch.py,
which imports Ray only when the command runs."""

from __future__ import annotations

from specula.runtime.serve.launch import add_serve_arguments


def register(sub) -> None:
    """Add ``serve`` to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("serve", help="run the distributed runtime on Ray Serve (vision encoder, drafter, verifier, ingress)",
                       description="Start (or join) Ray, deploy the Serve application described by --config and block "
                                   "until interrupted.")
    add_serve_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from specula.runtime.serve.launch import serve_cli

    return serve_cli(args)
