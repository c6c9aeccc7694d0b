# Sourced by the GPU machine's scripts (gpu_run.sh, gpu_serve.sh) from the repository root: install
# the carried wheels (.whl, from benchmarks/prepare_bench_assets.py; WHEELS_DIR=none uses what is
# installed) into /tmp/site, make the source folders importable as the `pensieve` package, and put
# the repository root on the path for the uninstalled `benchmarks` package.
if [ "${WHEELS_DIR:-.whl}" != none ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${WHEELS_DIR:-.whl}"/*.whl || exit 1
fi
# one package folder per source tree, so that builds run side by side (gpu_jobs.sh, or the
# before@/last@ variants of gpu_actors.sh) never import each other's modules
pkg=/tmp/pkg/$(printf %s "$PWD" | md5sum | cut -c1-12)
mkdir -p "$pkg/pensieve"
for folder in actors kernels models store ops; do ln -sfn "$PWD/$folder" "$pkg/pensieve/$folder"; done
export PYTHONPATH="$pkg:/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
export PYTHONUNBUFFERED=1

# options_of OPTION...: the words of $model (a list of `--option value` pairs) for the options
# named, with their values: what one `pensieve actor NAME` takes of them
options_of() {
    local -a words kept=()
    local i option
    read -ra words <<< "$model"
    for ((i = 0; i + 1 < ${#words[@]}; i += 2)); do
        for option in "$@"; do
            [ "${words[i]}" = "$option" ] && kept+=("${words[i]}" "${words[i + 1]}")
        done
    done
    echo "${kept[@]}"
}
