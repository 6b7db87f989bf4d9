"""Graphs: the immutable IR (:mod:`.ir`), the verifier (:mod:`.verify`), the three
front-ends — :class:`~.builder.GraphBuilder`, the seed-style layers
(:mod:`.layers`, lowered by :mod:`.sequential`) and ``Builder().build_operation``
for single ops — drawing (:mod:`.draw`) and saving (:mod:`.serialize`).
``GraphOp`` (:mod:`.graph_op`) runs them.

Submodules are imported on use, so importing this package stays light.
"""
