# Sourced by the device scripts (dev/cuda/*_run.sh, *_check.sh): the wheels
# of the folder $WHEELS (nvidia-cudnn-frontend: the device has no registry)
# installed without their dependencies into /tmp/fe. install_wheels LOG sets
# FE_DIR to /tmp/fe when they installed, else to nothing; each script puts
# it on its PYTHONPATH.
install_wheels() {
    FE_DIR=""
    if [ -n "$WHEELS" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/fe "$WHEELS"/*.whl > "$1" 2>&1 && FE_DIR=/tmp/fe
    fi
}
