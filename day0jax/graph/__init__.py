"""The day-0 checklist for a model_type day0jax does not implement (`python -m day0jax.check PATH --graph`).

`trace_torch.py` runs under another Python (one with torch and transformers) and traces the model's modeling code;
`mapping` says what day0jax has for each traced module class and torch function (the operators' specs own their
patterns); `report` turns a trace into covered / missing, costs, the nearest family and a verdict. This package never
imports torch.
"""
