"""The probe layer: what an adapter expects to find in vLLM, and where to look for it.

* :mod:`.shapes`: the declarative checks (``Param``, ``Attr``, ``FieldDefault``, ...), the
  observation values they return, and the :class:`~.shapes.Source` they read;
* :mod:`.live`: the live reader (imports vLLM, inspects the objects), used by ``apply()``;
* :mod:`.static`: the static reader (vLLM's files read with ``ast``), used by the audit;
* :mod:`.aliased`: either reader seen after bridging adapters put moved names back;
* :mod:`.verdicts`: the one decision rule (``judge``) both ``apply()`` and the audit apply.

This layer imports nothing above it (no registry, no adapters); importing the package itself
imports none of its modules.
"""
