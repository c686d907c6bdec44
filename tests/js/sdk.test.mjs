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

test('template build: COPY of a local dir, cache, tags', async () => {
  const { Template } = await import('e2b')
  const fs = await import('node:fs')
  const os = await import('node:os')
  const path = await import('node:path')
  const ctx = fs.mkdtempSync(path.join(os.tmpdir(), 'aenv-js-build-'))
  fs.mkdirSync(path.join(ctx, 'app'))
  fs.writeFileSync(path.join(ctx, 'app', 'hello.txt'), 'hello from js')
  const name = `js-built-${process.pid}`
  const t = () =>
    Template({ fileContextPath: ctx })
      .fromTemplate('base')
      .copy('app', '/opt/app')
      .runCmd('cat /opt/app/hello.txt > /opt/copied.txt', { user: 'root' })
  const first = await Template.build(t(), `${name}:v1`)
  assert.deepEqual(first.tags, ['v1'])
  const logs = []
  const second = await Template.build(t(), `${name}:v1`, {
    onBuildLogs: (e) => logs.push(e.message),
  })
  assert.equal(logs.filter((m) => m.includes(' CACHED')).length, 3, logs.join('\n'))
  const sbx = await Sandbox.create(`${name}:v1`, { timeoutMs: 60_000 })
  try {
    assert.equal(await sbx.files.read('/opt/copied.txt'), 'hello from js')
  } finally {
    await sbx.kill()
  }
  const info = await Template.assignTags(`${name}:v1`, 'stable')
  assert.equal(info.buildId, second.buildId) // v1 moved to the newest build
  const tags = (await Template.getTags(name)).map((x) => x.tag).sort()
  assert.deepEqual(tags, ['stable', 'v1'])
  await Template.removeTags(name, 'stable')
  const res = await fetch(`${process.env.E2B_API_URL}/templates/${first.templateId}`, {
    method: 'DELETE',
    headers: { 'X-API-Key': process.env.E2B_API_KEY },
  })
  assert.equal(res.status, 204)
})
