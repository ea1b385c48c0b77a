"""The built-in model: a GPT-style byte-level decoder (``models.gpt``), its tensor-parallel plan
and its shape config. A user of the engine like any other model."""
