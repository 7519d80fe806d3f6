"""The shift monitor: alarms when incoming maps leave the domain a detector was trained on.

`ShiftMonitor` (fit / score_maps / test_window / save / load) works on maps alone
and knows no server; `actmap.monitor.on_run` fits one next to a run folder and
measures alarm rates over windows of a store. See docs/monitor.md.
"""

from actmap.monitor.features import layer_profiles
from actmap.monitor.shift import MapScores, MonitorConfig, ShiftMonitor, WindowTest

__all__ = ["MapScores", "MonitorConfig", "ShiftMonitor", "WindowTest", "layer_profiles"]
