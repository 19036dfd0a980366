"""Score a `veil train --dataset fashion-mnist` run's ``release/model.pt`` on the raw test images.

The whitened scattering preset's released model carries P (``WhitenedRows``): this loads it into a
freshly built ``unit_rows_net(build_model("scatternet", ...))`` and compares its accuracy with the
report's. Usage::

    PYTHONPATH=../src python fashion_release_check.py /path/to/run
"""

import json
import sys
import time
from pathlib import Path

import torch

from veil.config import make_config
from veil.data import load_dataset
from veil.data.preprocess import build_transform, plan_preprocessing
from veil.models import build_model
from veil.models.scattering import unit_rows_net

run = sys.argv[1]
t = time.time()
state = torch.load(Path(run, "release", "model.pt"), weights_only=True)
ds = load_dataset("fashion-mnist", seed=1)
model = torch.nn.Sequential()
model.add_module("preprocess", build_transform(plan_preprocessing(make_config({}), ds), ds.input_shape))
model.add_module("net", unit_rows_net(build_model("scatternet", ds.input_shape, ds.num_classes, "image")))
model.load_state_dict(state)
model.eval()
hits = 0
with torch.no_grad():
    for i in range(0, len(ds.y_test), 500):
        x = torch.from_numpy(ds.x_test[i : i + 500])
        hits += int((model(x).argmax(1).numpy() == ds.y_test[i : i + 500]).sum())
rep = json.loads(Path(run, "report.json").read_text())
print(
    "raw-image accuracy",
    hits / len(ds.y_test),
    "reported",
    rep["non_private"]["test_accuracy"],
    "P",
    tuple(state["net.features.2.whitener"].shape),
    round(time.time() - t, 1),
    "s",
)
