"""The step modes: how the Trainer runs an optimizer step among its ranks (docs/architecture.md
draws them). ``base.py``: the StepMode every mode is and the normal mode; ``choice.py``: the
one the configuration asks for. The reproducible mode (training/reproducible/mode.py) and the
fault-tolerant members' mode (training/fault_tolerance/mode.py), which wraps it, live beside
their packages; neither imports the other."""
