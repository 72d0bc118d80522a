"""What is known before the model loads, and the samples still to do.

* ``planner.py``: the model's plan (:class:`planner.ModelPlan`: its facts, format and layers), the
  memory and audit checks; what ``serve`` calls alone;
* ``run_plan.py``: what ``extract`` and ``generate`` add (the input's first samples, the output
  directory read, the disk, the time) and the frozen :class:`run_plan.RunPlan`;
* ``preflight.py``: the checks of the model, the host's memory, the environment and vLLM before
  any weight loads; ``run_checks.py``: those of the run's input and output directory;
* ``estimates.py``: the run's time, from measured rates;
* ``batches.py``: the samples still to do (:class:`batches.Pending`) and the replica modes that hand
  them out in batches.
"""
