# After the package went (not on upgrade): the virtual environment the post-install step built goes
# with it (it is code); the data stays: /var/lib/cortex (models), /var/cache/cortex, the user, and
# /etc/cortex as you edited it (RPM keeps edited files as .rpmsave; Debian until `purge`).
rm -rf /opt/cortex/venv
rmdir /opt/cortex/lib /opt/cortex/wheels /opt/cortex 2>/dev/null || true
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload || true
fi
