"""Graph building: the exportable step, torch.export and the ONNX lowering with the project's own translations,
and the passes that tidy the lowered graph."""
