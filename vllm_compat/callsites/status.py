"""What a checked call site or subclass contract is: ``ok``; ``bridged`` (broken in vLLM, an adapter
applied by the consumer makes it work); ``PROBLEM`` (it would break); ``warning`` (said, never counted
as a problem: a break that cannot fail the consumer when it runs, such as an import under ``if
TYPE_CHECKING:``, or an override that no longer replaces anything)."""

OK, BRIDGED, PROBLEM, WARNING = "ok", "bridged", "PROBLEM", "warning"
