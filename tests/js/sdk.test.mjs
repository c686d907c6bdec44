// The e2b npm SDK, unmodified, against a running aenv node.
// Run by tests/e2e/test_js_sdk.py with E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from 'e2b'

const template = process.env.AENV_TEST_TEMPLATE || 'base'

test('create, run, files, list, kill', async () => {
  const sbx = await Sandbox.create(template, { timeoutMs: 120_000, metadata: { suite: 'js' } })
  try {
    const r = await sbx.commands.run('echo hello from $(id -un)')
    assert.equal(r.exitCode, 0)
    assert.equal(r.stdout.trim(), 'hello from user')

    await assert.rejects(sbx.commands.run('exit 4'), (e) => e.exitCode === 4)

    const chunks = []
    await sbx.commands.run('echo a; sleep 0.3; echo b', { onStdout: (d) => chunks.push(d.trim()) })
    assert.deepEqual(chunks, ['a', 'b'])

    await sbx.files.write('/home/user/js.txt', 'written by js')
    assert.equal(await sbx.files.read('/home/user/js.txt'), 'written by js')
    const entries = await sbx.files.list('/home/user')
    assert.ok(entries.some((e) => e.name === 'js.txt'))

    const listed = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
    assert.deepEqual(listed.map((s) => s.sandboxId), [sbx.sandboxId])
  } finally {
    await sbx.kill()
  }
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
})
