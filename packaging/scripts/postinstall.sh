# After the files are in place (RPM %post, Debian postinst configure), on install and upgrade.
# The folders the units may write (ReadWritePaths=), owned by the service user:
install -d -o cortex -g cortex -m 0750 /var/lib/cortex /var/lib/cortex/models /var/cache/cortex
# Cortex's own virtual environment, from the wheel this package brings (pip reaches PyPI, or the
# index /etc/pip.conf or PIP_INDEX_URL names); a failure here leaves the files installed and says
# how to finish
/opt/cortex/lib/make-venv || echo "cortex: the virtual environment is not complete; once pip can reach its index, run /opt/cortex/lib/make-venv" >&2
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  # an upgrade restarts what runs (a node drains first: SIGTERM); nothing starts by itself on install
  systemctl try-restart cortex-gateway.service cortex-batch.service 'cortex-node@*.service' || true
fi
