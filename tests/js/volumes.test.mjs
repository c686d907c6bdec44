// Volumes with the e2b npm SDK, unmodified, against a running aenv node.
// Run by tests/e2e/test_js_volumes.py with E2B_API_URL, E2B_SANDBOX_URL,
// E2B_VOLUME_API_URL and E2B_API_KEY set.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, Volume } from 'e2b'

const template = process.env.AENV_TEST_TEMPLATE || 'base'

test('volume CRUD, content API and a sandbox mounting it', async () => {
  const name = `js-vol-${Math.random().toString(36).slice(2, 10)}`
  const vol = await Volume.create(name)
  try {
    assert.equal(vol.name, name)
    assert.ok((await Volume.list()).some((v) => v.volumeId === vol.volumeId))
    assert.equal((await Volume.getInfo(vol.volumeId)).token, vol.token)

    await vol.makeDir('/js/deep', { force: true })
    const stat = await vol.writeFile('/js/deep/a.txt', 'from js')
    assert.equal(stat.size, 7)
    // a stream is sent chunked, without a length
    const big = new Uint8Array(2 * 1024 * 1024 + 3).map((_, i) => i % 251)
    const stream = new Blob([big]).stream()
    await vol.writeFile('/js/big.bin', stream)
    assert.deepEqual(await vol.readFile('/js/big.bin', { format: 'bytes' }), big)
    assert.equal(await vol.readFile('/js/deep/a.txt'), 'from js')
    const listed = await vol.list('/js')
    assert.deepEqual(listed.map((e) => e.name).sort(), ['big.bin', 'deep'])
    assert.equal(await vol.exists('/nope'), false)

    const sbx = await Sandbox.create(template, { timeoutMs: 120_000, volumeMounts: { '/mnt/js': vol } })
    try {
      const r = await sbx.commands.run('cat /mnt/js/js/deep/a.txt; echo in-sbx > /mnt/js/b.txt')
      assert.equal(r.stdout, 'from js')
      assert.equal(await vol.readFile('/b.txt'), 'in-sbx\n')
      await assert.rejects(Volume.destroy(vol.volumeId), /mounted by/)
    } finally {
      await sbx.kill()
    }
    await vol.remove('/js')
    assert.equal(await vol.exists('/js/deep/a.txt'), false)
  } finally {
    assert.equal(await Volume.destroy(vol.volumeId), true)
  }
  assert.equal(await Volume.destroy(vol.volumeId), false)
})
