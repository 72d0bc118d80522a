"""A small in-process stand-in for Ray that runs each call at once, with faults to order: shared by
the unit tests of Ray replicas (support module)."""
from __future__ import annotations

import pickle


class ActorDied(Exception):
    pass


class Ref:
    def __init__(self, value=None, error=None):
        self.value, self.error = value, error


class FakeActor:
    """Runs each call when it is made. ``fault``: (what, n) — at its n-th ``extract`` call the actor
    dies (its writer's files reach the disk first, as a killed process's renamed files do), or that
    call and every later one raises; ("poison", i): every call holding sample ``i`` raises."""

    def __init__(self, instance, fault):
        self.instance, self.fault, self.dead, self.extracts = instance, fault, False, 0

    def __getattr__(self, name):
        actor = self

        class Method:
            @staticmethod
            def remote(*args):
                if actor.dead:
                    return Ref(error=ActorDied("The actor died unexpectedly before finishing this task."))
                if name == "extract":
                    actor.extracts += 1
                    what, n = actor.fault or (None, 0)
                    if what == "die" and actor.extracts == n:
                        actor.instance.work.model.writer.close()
                        actor.dead = True
                        return Ref(error=ActorDied("The actor died unexpectedly before finishing this task."))
                    poisoned = what == "poison" and any(sample.index == n for sample in args[0])
                    if poisoned or (what == "raise" and actor.extracts >= n):
                        return Ref(error=RuntimeError("Traceback (most recent call last):\n  ...\nValueError: boom"))
                return Ref(getattr(actor.instance, name)(*args))

        return Method


class FakeRay:
    __version__ = "fake"

    class exceptions:
        RayActorError = ActorDied

    def __init__(self, faults):
        self.faults, self.actors, self.up = faults, [], False

    def init(self, **kwargs):
        self.up = True

    def is_initialized(self):
        return self.up

    def shutdown(self):
        self.up = False

    def cluster_resources(self):
        return {"CPU": 4.0}

    def remote(self, cls):
        ray = self

        class ActorClass:
            @staticmethod
            def options(**kwargs):
                return ActorClass

            @staticmethod
            def remote(plan, replica_id, env):
                fault = ray.faults.get(replica_id, ray.faults.get("every"))
                actor = FakeActor(cls(pickle.loads(pickle.dumps(plan)), replica_id, env), fault)  # as Ray ships it
                ray.actors.append(actor)
                return actor

        return ActorClass

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs, num_returns=1, timeout=None):
        return refs[:num_returns], refs[num_returns:]

    def kill(self, actor):
        actor.dead = True
