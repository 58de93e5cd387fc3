# Sourced by setup.sh and install_vllm_cpu.sh (with the target venv active): `pkg_install ARGS...`
# installs packages into it with uv when uv can be had, else with pip.
#
# uv resolves the same versions as pip here (the two venvs' `pip list` were identical) and installs
# them in parallel: a fresh `scripts/setup.sh` took 1 min 41-45 s against 3 min 42 s - 4 min 29 s
# with pip on the 2-core machine (2026-12-03, docs/benchmarks.md "Set-up and CI"). uv reads no
# pip.conf, so pip's find-links, index, extra indexes, trusted hosts, no-index and certificate (its
# config files or PIP_* variables) are handed to uv as UV_* variables; bytecode is compiled as pip
# does.
# EARL_INSTALLER=pip keeps pip. If uv cannot be installed, or an install by uv fails, the same
# install runs with pip (a message says so).

_pip_setting() {  # $1: pip's option name; the PIP_ variable wins over pip's config files
  local var="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  python -m pip config get "global.$1" 2>/dev/null | tr '\n' ' ' || true
}

_use_uv() {
  case "${EARL_INSTALLER:-uv}" in
    uv) ;;
    pip) return 1 ;;
    *) echo "setup: EARL_INSTALLER='${EARL_INSTALLER}' is not an installer this set-up knows; use 'uv' (the default) or 'pip'" >&2
       exit 2 ;;
  esac
  [ -x "$VIRTUAL_ENV/bin/uv" ] && return 0
  python -m pip install -q "uv>=0.9,<1" >/dev/null 2>&1 && return 0
  echo "setup: uv could not be installed; using pip"
  return 1
}

_uv_env() {  # the UV_* settings that make uv install what pip would, one KEY=VALUE a line
  local find_links index extra trusted no_index cert
  find_links=$(echo $(_pip_setting find-links)) index=$(echo $(_pip_setting index-url))
  extra=$(echo $(_pip_setting extra-index-url)) trusted=$(echo $(_pip_setting trusted-host))
  no_index=$(echo $(_pip_setting no-index) | tr 'A-Z' 'a-z') cert=$(echo $(_pip_setting cert))
  echo "UV_PYTHON=$VIRTUAL_ENV/bin/python"
  echo "UV_COMPILE_BYTECODE=1"
  echo "UV_INDEX_STRATEGY=unsafe-best-match"  # as pip: the best version over every index
  [ -z "$find_links" ] || echo "UV_FIND_LINKS=${find_links// /,}"
  [ -z "$extra" ] || echo "UV_EXTRA_INDEX_URL=$extra"
  [ -z "$index" ] || echo "UV_INDEX_URL=$index"
  [ -z "$trusted" ] || echo "UV_INSECURE_HOST=$trusted"
  case "$no_index" in 1|true|yes|on) echo "UV_NO_INDEX=1" ;; esac
  [ -z "$cert" ] || echo "SSL_CERT_FILE=$cert"
}

pkg_install() {
  if _use_uv; then
    local -a uv_env
    mapfile -t uv_env < <(_uv_env)
    if env "${uv_env[@]}" "$VIRTUAL_ENV/bin/uv" pip install -q "$@"; then
      return 0
    fi
    echo "setup: 'uv pip install $*' failed; trying pip"
  fi
  python -m pip install -q "$@"
}

pkg_uninstall() {
  if _use_uv; then
    env UV_PYTHON="$VIRTUAL_ENV/bin/python" "$VIRTUAL_ENV/bin/uv" pip uninstall -q "$@" 2>/dev/null || true
  else
    python -m pip uninstall -q -y "$@" || true
  fi
}
