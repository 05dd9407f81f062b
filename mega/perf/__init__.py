"""The performance model and planner (docs/perf-model.md): step time, MFU and memory per GPU of a
training configuration as a sum of explicit terms (``step``, ``memory``, ``scale``) on the hardware
of a cluster preset with its device type's efficiencies (``hardware``, ``device``,
``calibrate_cuda``) or of a calibration of this CPU machine (``calibrate``), validated leave one
source out against published runs (``published``); the planner chooses open knobs and searches
layouts (``planner``).
The CLI is ``python -m mega.plan``."""

from mega.perf.hardware import Hardware
from mega.perf.planner import Evaluation, evaluate, hardware_for, search
from mega.perf.step import Prediction, predict

__all__ = ["Evaluation", "Hardware", "Prediction", "evaluate", "hardware_for", "predict", "search"]
