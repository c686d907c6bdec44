// Host-name egress rules through the e2b npm SDK, unmodified, against a running aenv node.
// Run by tests/e2e/test_egress.py with E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set and
// EGRESS_CA (the test internet's CA, PEM), EGRESS_ALLOWED_IP, EGRESS_OTHER_IP and
// EGRESS_PROXY (the internet's SOCKS5 server, credentials u/pw, host:port).
import { test } from 'node:test'
import assert from 'node:assert/strict'
import crypto from 'node:crypto'
import { ALL_TRAFFIC, Sandbox, Secret } from 'e2b'

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

// Run inside the sandbox with allowed.test pinned in /etc/hosts, trusting the node's CA
// through the system store (no --cacert): the request the rules' host receives.
async function headersSeen(sbx) {
  const r = await sbx.commands.run(
    'curl -sS -m 5 -H "X-Api-Key: mine" https://allowed.test/headers 2>&1 || echo fail:$?',
    { timeoutMs: 30_000 },
  )
  return r.stdout
}

test('rules inject a secret header the sandbox never holds', async () => {
  const value = `sk-js-${Math.random().toString(36).slice(2)}${Date.now()}`
  const name = `js-egress-key-${Date.now()}`
  const secret = await Secret.create(name, value)
  const sbx = await Sandbox.create(template, {
    timeoutMs: 120_000,
    network: {
      allowOut: ({ rules }) => [...rules.keys()],
      denyOut: [ALL_TRAFFIC],
      rules: { 'allowed.test': [{ transform: { headers: { 'X-Api-Key': Secret.fill(name) } } }] },
    },
  })
  try {
    await sbx.commands.run(`printf '${allowedIp} allowed.test\\n' >> /etc/hosts`, { user: 'root' })
    const seen = await headersSeen(sbx)
    assert.match(seen, new RegExp(`X-Api-Key: ${value}`))
    assert.doesNotMatch(seen, /X-Api-Key: mine/)
    const env = await sbx.commands.run("env; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'")
    assert.ok(!env.stdout.includes(value))
    const info = await sbx.getInfo()
    assert.deepEqual(info.network?.rules?.['allowed.test'], [
      { transform: { headers: { 'X-Api-Key': Secret.fill(name) } } },
    ])
    // the secret's info never carries the value
    assert.ok(!JSON.stringify(await Secret.getInfo(secret.secretId)).includes(value))
  } finally {
    await sbx.kill()
    await Secret.destroy(secret.secretId)
  }
})

test('iam token minted per request and verified against the JWKS', async () => {
  const sbx = await Sandbox.create(template, {
    timeoutMs: 120_000,
    iam: { tokens: { aws: Secret.iamToken({ audience: 'sts.js.test', tokenType: 'JWT-SVID' }) } },
    network: {
      allowOut: ['allowed.test'],
      denyOut: [ALL_TRAFFIC],
      rules: {
        'allowed.test': [
          { transform: ({ iam }) => ({ headers: { Authorization: `Bearer ${iam.tokens.aws}` } }) },
        ],
      },
    },
  })
  try {
    await sbx.commands.run(`printf '${allowedIp} allowed.test\\n' >> /etc/hosts`, { user: 'root' })
    const line = (await headersSeen(sbx)).split('\n').find((l) => l.startsWith('Authorization:'))
    assert.ok(line?.startsWith('Authorization: Bearer ey'), line)
    const token = line.split(' ').pop().trim()
    const [head, body, sig] = token.split('.')
    const api = process.env.E2B_API_URL.replace(/\/$/, '')
    const conf = await (await fetch(`${api}/.well-known/openid-configuration`)).json()
    const jwks = await (await fetch(conf.jwks_uri)).json()
    const header = JSON.parse(Buffer.from(head, 'base64url'))
    const jwk = jwks.keys.find((k) => k.kid === header.kid)
    assert.ok(jwk, 'the token is signed by a key of the JWKS')
    const key = crypto.createPublicKey({ key: jwk, format: 'jwk' })
    const ok = crypto.verify('RSA-SHA256', Buffer.from(`${head}.${body}`), key, Buffer.from(sig, 'base64url'))
    assert.ok(ok, 'the signature verifies')
    const claims = JSON.parse(Buffer.from(body, 'base64url'))
    assert.equal(claims.iss, conf.issuer)
    assert.equal(claims.aud, 'sts.js.test')
    assert.equal(claims.sandbox_id, sbx.sandboxId)
  } finally {
    await sbx.kill()
  }
})

test('egressProxy tunnels through SOCKS5, password never reported', async () => {
  const proxy = { address: process.env.EGRESS_PROXY, username: 'u', password: 'pw' }
  const sbx = await Sandbox.create(template, {
    timeoutMs: 120_000,
    network: { allowOut: ['other.test'], denyOut: [ALL_TRAFFIC], egressProxy: proxy },
  })
  try {
    await sbx.files.write('/tmp/ca.pem', process.env.EGRESS_CA)
    const proxyIp = proxy.address.split(':')[0]
    assert.match(await fetchIn(sbx, 'other.test', otherIp), new RegExp(`peer=${proxyIp}$`))
    const info = await sbx.getInfo()
    assert.deepEqual(info.network?.egressProxy, { address: proxy.address, username: 'u' })
    // a proxy with the wrong password: fails closed, nothing goes direct
    await sbx.updateNetwork({
      allowOut: ['other.test'],
      denyOut: [ALL_TRAFFIC],
      egressProxy: { ...proxy, password: 'nope' },
    })
    assert.match(await fetchIn(sbx, 'other.test', otherIp), /fail:/)
  } finally {
    await sbx.kill()
  }
})
