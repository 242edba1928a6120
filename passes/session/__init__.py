"""Session: passes that tune how ONNX Runtime runs the model (session recipe, shapes, memory)."""
