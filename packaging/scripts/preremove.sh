# Before the package goes (not on upgrade): stop and disable every Cortex unit. A node drains as on
# any SIGTERM.
if [ -d /run/systemd/system ]; then
  systemctl stop cortex-gateway.service cortex-batch.service 'cortex-node@*.service' || true
  systemctl disable cortex-gateway.service cortex-batch.service cortex-node@.service || true
fi
