"""``dynpipe demo``: static against adaptive on a shared CPU machine, in one command.

It sits above ``runtime`` (it launches two training jobs) and ``analysis`` (it reads their
logs and draws their figures); neither of those imports it.

    from dynpipe.demo import DemoConfig, run_demo
    run_demo(DemoConfig(quick=True, out="runs/demo"))
"""

from __future__ import annotations

from dynpipe.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
