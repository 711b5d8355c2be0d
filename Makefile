# `make run`: set up .venv and run the demo sweep on the embedded default.
# `make test`: set up .venv and run the test suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install system-deps clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24" setuptools wheel
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/fusetune demo

# Tools the tests drive that PyPI does not carry: docker-compose validates docker-compose.yml;
# Debian's Chromium runs the dashboard's browser tests (Playwright drives /usr/bin/chromium;
# its own browser download is not used).
system-deps:
	@command -v docker-compose >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null; }
	@test -x /usr/bin/chromium || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# ruff over the repository; mypy over the five packages, laid out as the fusetune package
# through a tree of links (mypy cannot follow setuptools' editable-install finder).
PACKAGES := server scheduler fusion workers client
lint: $(STAMP)
	$(BIN)/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck/fusetune
	for d in $(PACKAGES) migrations; do ln -s ../../../$$d build/typecheck/fusetune/$$d; done
	MYPYPATH=build/typecheck $(BIN)/mypy $(foreach p,$(PACKAGES),-p fusetune.$(p))

# Two test processes (pytest-xdist), each with its own local Ray, one a core: the suite keeps
# both cores busy (three processes took 16:51 against two's 14:53 on 7 December, the cores 94%
# busy, most of it the live services' Ray workers starting and training). The slow live tests
# come last; worksteal hands a process that runs dry some of the other's share.
test: $(STAMP) system-deps lint
	$(BIN)/python -m pytest -n 2 --dist worksteal

clean:
	rm -rf $(VENV) fusetune.db fusetune.db.scheduler.lock artifacts
