"""Llama-style decoder: NNX layer declarations and the functional boundary."""

from jaxpar.model.llama import Model, Params, cross_entropy

__all__ = ["Model", "Params", "cross_entropy"]
