# Sourced by scripts/demo, scripts/test and scripts/bench: makes .venv and the
# system packages ready on a fresh machine. Idempotent and quiet when done.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY="${PYTHON:-python3}"

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v setpriv >/dev/null 2>&1 || need_apt+=(util-linux)
command -v prlimit >/dev/null 2>&1 || need_apt+=(util-linux)
[ -e /usr/lib/x86_64-linux-gnu/libseccomp.so.2 ] || [ -e /usr/lib/aarch64-linux-gnu/libseccomp.so.2 ] \
  || ls /usr/lib/*/libseccomp.so.2 >/dev/null 2>&1 || need_apt+=(libseccomp2)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# Development tools, not runtime needs (scripts/test sets CORRAL_BOOTSTRAP_EXTRA=test,
# scripts/bench sets bench; scripts/demo needs none of them):
# - PostgreSQL's server binaries: the PostgreSQL store's tests and `scripts/bench
#   sessions --pg` start a throwaway cluster with initdb + pg_ctl
#   (supervisor/devtools/pgserver.py);
# - the image tests and the image benchmark build OCI images offline with umoci
#   and skopeo from busybox-static (docs/images.md).
if [ "${CORRAL_BOOTSTRAP_EXTRA:-}" = test ] || [ "${CORRAL_BOOTSTRAP_EXTRA:-}" = bench ]; then
  ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need_apt+=(postgresql)
  command -v umoci >/dev/null 2>&1 || need_apt+=(umoci)
  command -v skopeo >/dev/null 2>&1 || need_apt+=(skopeo)
  [ -x /bin/busybox ] || need_apt+=(busybox-static)
fi
# The web view's browser test (tests/telemetry/test_web.py) drives Debian's
# chromium with playwright (browsers cannot be downloaded), and the CLI's
# terminal tests drive tmux (tests/cli/test_terminal.py): test extra only.
if [ "${CORRAL_BOOTSTRAP_EXTRA:-}" = test ]; then
  command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
  command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing system packages: ${need_apt[*]}" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    echo "bootstrap: missing system packages (${need_apt[*]}); install them, for example:" >&2
    echo "  sudo apt-get install -y ${need_apt[*]}" >&2
    echo "bootstrap: continuing; the sandbox will report a lower tier." >&2
  fi
fi

# What to install: the runtime only (scripts/demo, scripts/bench), or with the
# test extra too (scripts/test sets CORRAL_BOOTSTRAP_EXTRA=test before sourcing).
# The runtime alone installs in about half the time on a fresh machine; a venv
# that already has the test extra satisfies a runtime-only caller.
extra="${CORRAL_BOOTSTRAP_EXTRA:-}"
stamp_runtime="$VENV/.corral-installed"
stamp_test="$VENV/.corral-installed-test"
if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
fresh() { [ -f "$1" ] && [ ! "$REPO/pyproject.toml" -nt "$1" ]; }
# The installer: uv (a well-kept resolver and installer from Astral, itself a
# wheel from PyPI) when it can be had, else pip. Installing corral's ~60
# packages from a warm cache took 22 CPU-s with pip against 3 with uv (2.5 more
# to fetch uv itself) on the 2-core development machine; that is most of a new
# user's first `scripts/demo` and of the fresh-clone test. uv does not read
# pip's configuration, so where only a pip mirror is reachable uv fails and pip
# (which reads it) does the install. CORRAL_BOOTSTRAP_PIP=1 skips uv.
install() {
  if [ "${CORRAL_BOOTSTRAP_PIP:-0}" != 1 ]; then
    if [ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q \
        --disable-pip-version-check uv >/dev/null 2>&1; then
      if "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" "$@"; then
        return 0
      fi
      echo "bootstrap: uv could not install; trying pip" >&2
    fi
  fi
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"
}
if [ "$extra" = test ]; then
  if ! fresh "$stamp_test"; then
    echo "bootstrap: installing corral (editable) with its test extra" >&2
    install -e "$REPO[test]"
    touch "$stamp_test" "$stamp_runtime"
  fi
elif ! fresh "$stamp_runtime" && ! fresh "$stamp_test"; then
  echo "bootstrap: installing corral (editable)" >&2
  install -e "$REPO"
  touch "$stamp_runtime"
fi
export PATH="$VENV/bin:$PATH"

# Byte-compile the project once (only what changed since; about 0.3 s when up to
# date). Every farm process, CLI call and test child imports these modules, and
# with PYTHONDONTWRITEBYTECODE set (as on CI and in many containers) nothing
# would ever be cached: each of the thousands of processes a test run starts
# compiled ~290 modules from source (0.3 s of CPU each, measured).
"$VENV/bin/python" -m compileall -q -j 0 "$REPO/broker" "$REPO/supervisor" \
  "$REPO/sandbox_worker" "$REPO/tests" >/dev/null || true
