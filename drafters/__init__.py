"""specula.drafters: every drafting method behind one protocol, plus their training recipes. No Ray, no gRPC."""

from specula.drafters.protocol import DraftContext, Drafter, DrafterSpec, Proposal, Verdict
from specula.drafters.registry import create, kinds, register

__all__ = ["DraftContext", "Drafter", "DrafterSpec", "Proposal", "Verdict", "create", "kinds", "register"]
