"""Synthetic vLLM wheels for the audit's unit tests: a few files of a release, zipped (support module)."""
import zipfile

VLLM_FILES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.17.0'\n",
    "vllm/v1/request.py": "class Request:\n    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params):\n        pass\n",
}


def make_wheel(path, files):
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def declaring_wheel(directory, package: str = "declaring", package_source: str = "import vllm\n"):
    """``<package>-1.0`` as a wheel whose dist-info declares one touch point in the audit's entry-point
    group (``<package>:x``, pointing at a module that does not exist: it must be read, never loaded)."""
    from vllm_compat.consumer import TOUCHPOINTS_GROUP

    return make_wheel(directory / f"{package}-1.0-py3-none-any.whl", {
        f"{package}/__init__.py": package_source,
        f"{package}-1.0.dist-info/METADATA": f"Name: {package}\nVersion: 1.0\n",
        f"{package}-1.0.dist-info/entry_points.txt":
            f"[{TOUCHPOINTS_GROUP}]\n{package}:x = {package}_never_imported:TOUCHPOINTS\n"})


# VLLM_FILES with an engine core that makes steps, a scheduler and an executor: what a consumer's
# generator is compared with (the audit's engine steps); `Gone`, `Deep` and `Outside` are in none of it
ENGINE_VLLM_FILES = dict(VLLM_FILES, **{
    "vllm/v1/__init__.py": "",
    "vllm/v1/core/__init__.py": "",
    "vllm/v1/core/sched/__init__.py": "",
    "vllm/v1/core/sched/interface.py": "class SchedulerInterface:\n    def schedule(self):\n        pass\n",
    "vllm/v1/core/sched/scheduler.py": ("from vllm.v1.core.sched.interface import SchedulerInterface\n"
                                        "class Scheduler(SchedulerInterface):\n"
                                        "    def __init__(self, config):\n        pass\n"
                                        "    def schedule(self):\n        pass\n"
                                        "    def has_requests(self):\n        pass\n"),
    "vllm/v1/executor/__init__.py": "",
    "vllm/v1/executor/abstract.py": ("class Executor:\n    def __init__(self, config):\n        pass\n"
                                     "    def execute_model(self, out):\n        pass\n"
                                     "    def warm_up(self):\n        pass\n"),
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/core.py": ("from vllm.v1.executor.abstract import Executor\n"
                               "from vllm.v1.core.sched.scheduler import Scheduler\n"
                               "class EngineCore:\n"
                               "    def __init__(self, config):\n"
                               "        self.model_executor = Executor(config)\n"
                               "        self.model_executor.warm_up()\n"
                               "        self.scheduler = Scheduler(config)\n"
                               "    def step(self):\n"
                               "        if self.scheduler.has_requests():\n"
                               "            out = self.scheduler.schedule()\n"
                               "            self.model_executor.execute_model(out)\n"
                               "    def post_step(self):\n"
                               "        pass\n"),
})
