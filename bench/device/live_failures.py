"""A pytest plugin for the device's test stages (``-p live_failures``): each failed test's report is
appended to ``$OUT/failures.txt`` as soon as it fails. A stage cut short by its deadline never
reaches pytest's end-of-run report, and the machine is gone before anyone can look again."""
import os


def pytest_runtest_logreport(report):
    if report.failed:
        path = os.path.join(os.environ.get("OUT", "."), "failures.txt")
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
