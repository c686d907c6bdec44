// Host-name egress rules through the e2b npm SDK, unmodified, against a running aenv node.
// Run by tests/e2e/test_egress.py with E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set and
// EGRESS_CA (the test internet's CA, PEM), EGRESS_ALLOWED_IP, EGRESS_OTHER_IP.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

const template = process.env.AENV_TEST_TEMPLATE || 'base'
const allowedIp = process.env.EGRESS_ALLOWED_IP
const otherIp = process.env.EGRESS_OTHER_IP

async function fetchIn(sbx, name, ip) {
  const cmd = `curl -sS -m 5 --cacert /tmp/ca.pem --resolve ${name}:443:${ip} https://${name}/ 2>&1 || echo fail:$?`
  const r = await sbx.commands.run(cmd, { timeoutMs: 30_000 })
  return r.stdout.trim()
}

test('allowOut names, denyOut all, updateNetwork', async () => {
  const sbx = await Sandbox.create(template, {
    timeoutMs: 120_000,
    network: { allowOut: ['allowed.test'], denyOut: ['0.0.0.0/0'] },
  })
  try {
    await sbx.files.write('/tmp/ca.pem', process.env.EGRESS_CA)
    assert.match(await fetchIn(sbx, 'allowed.test', allowedIp), new RegExp(`^from ${allowedIp} `))
    assert.match(await fetchIn(sbx, 'other.test', otherIp), /fail:/)
    assert.match(await fetchIn(sbx, 'allowed.test', otherIp), /fail:/)
    const info = await sbx.getInfo()
    assert.deepEqual(info.network?.allowOut, ['allowed.test'])

    await sbx.updateNetwork({ allowOut: ['other.test'], denyOut: ['0.0.0.0/0'] })
    assert.match(await fetchIn(sbx, 'other.test', otherIp), new RegExp(`^from ${otherIp} `))
    assert.match(await fetchIn(sbx, 'allowed.test', allowedIp), /fail:/)
  } finally {
    await sbx.kill()
  }
})
