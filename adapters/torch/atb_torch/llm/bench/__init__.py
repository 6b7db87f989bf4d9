"""``atb bench``: HF eager vs atb on the embedded default model and MiniLM (see
:mod:`.runner` for what is measured, :mod:`.measure` for how)."""
