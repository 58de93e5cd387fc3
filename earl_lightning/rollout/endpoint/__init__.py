"""The OpenAI-compatible endpoint a user's agent calls during a rollout: the server
(:mod:`.server`), the wire format (:mod:`.protocol`), each episode's recorded calls
(:mod:`.record`) and the rollout that runs the agents and generates for their calls
(:mod:`.session`)."""

from earl_lightning.rollout.endpoint.server import EndpointServer
from earl_lightning.rollout.endpoint.session import agent_rollout

__all__ = ["EndpointServer", "agent_rollout"]
