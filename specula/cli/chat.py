"""``specula chat``: ask a running server one question over its public gRPC API (runtime/api_client.py, imported
only when the command runs: it needs grpc)."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    """Add ``chat`` to the top-level sub-parsers ``sub``."""
    p = sub.add_parser("chat", help="ask a running server one question over its gRPC API",
                       description="A small client of the public gRPC API (specula.runtime.api_client): prints the answer "
                                   "as it is generated.")
    p.add_argument("question", help="what to ask; '<image>' marks where each image goes (default: images first)")
    p.add_argument("--image", action="append", default=[], help="image file (PNG/JPEG/WebP), repeatable")
    p.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC API (default: 127.0.0.1:50051)")
    p.add_argument("--token", default=None, help="API key (default: the SPECULA_API_KEY environment variable)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print the answer as it is generated (default); --no-stream waits for the whole answer")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (the server's default)")
    p.add_argument("--max-tokens", type=int, default=None, help="new tokens at most (server default: 64)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same answer)")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (default: none)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (system CA roots unless --ca-cert)")
    p.add_argument("--ca-cert", default=None, help="PEM file of the CA that signed the server's certificate")
    p.add_argument("--stats", action="store_true", help="print finish reason, tokens and tau to stderr at the end")
    p.set_defaults(func=run)


def run(args) -> int:
    from specula.runtime.api_client import chat_cli

    return chat_cli(args)
