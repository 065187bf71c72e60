"""Mixtures of experts (issue 40, in progress): the top-k router so far; token dispatch over
the expert-parallel group and grouped expert GEMMs are to come."""

from .router import RouterConfig, Routing, route

__all__ = ["RouterConfig", "Routing", "route"]
