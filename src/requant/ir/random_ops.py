"""A model that draws random numbers (a text-to-speech VITS's noise: ``RandomNormalLike`` without a
``seed``) computes other values at every run, so its float and int8 outputs differ even where
quantization changes nothing, and its calibration statistics change run to run.

While requant works on it, each unseeded random op gets a seed of its own (``seeded``): ONNX Runtime
then draws the same sequence in every session opened on the model, so float's and int8's runs of the
same samples, in the same order, see the same noise, and the same model, data and options give the same
bytes. The model requant writes draws as the user's did (``unseeded``): the seeds it added are removed.
"""

from __future__ import annotations

import hashlib

import onnx_ir as ir

__all__ = ["RANDOM_OPS", "SEEDED_KEY", "seeded", "unseeded"]

RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
SEEDED_KEY = "requant.seeded"  # the node's metadata: requant gave it its seed


def seeded(model: ir.Model) -> list[str]:
    """Give every random op of ``model`` without a seed one (from its name, the same wherever the node moves),
    in place; their names."""
    names = []
    for position, node in enumerate(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.domain in ("", "ai.onnx") and node.op_type in RANDOM_OPS and "seed" not in node.attributes:
            digest = hashlib.sha256(str(node.name or position).encode()).digest()
            node.attributes["seed"] = ir.AttrFloat32("seed", float(int.from_bytes(digest[:2], "little")))
            node.metadata_props[SEEDED_KEY] = "1"
            names.append(str(node.name))
    return names


def unseeded(model: ir.Model) -> ir.Model:
    """``model`` with the seeds :func:`seeded` gave removed, in place (it draws as the user's model did)."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.metadata_props.pop(SEEDED_KEY, None) is not None:
            node.attributes.pop("seed", None)
    return model
