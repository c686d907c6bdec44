// The @e2b/code-interpreter npm SDK, unmodified, against a running aenv node's
// code-interpreter-v1 template. Run by tests/e2e/test_code_interpreter.py with
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY set.
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'

test('runCode: state, streaming, errors, charts, contexts', async () => {
  const sbx = await Sandbox.create({ timeoutMs: 300_000, requestTimeoutMs: 300_000 })
  try {
    const first = await sbx.runCode('x = 20\nx * 2')
    assert.equal(first.text, '40')
    const out = []
    const second = await sbx.runCode('print("x is", x)\nx + 1', {
      onStdout: (m) => out.push(m.line),
    })
    assert.deepEqual(out, ['x is 20\n'])
    assert.equal(second.text, '21')
    assert.equal(second.executionCount, first.executionCount + 1)

    const failed = await sbx.runCode('raise ValueError("bad value")')
    assert.equal(failed.error.name, 'ValueError')
    assert.equal(failed.error.value, 'bad value')
    assert.match(failed.error.traceback, /ValueError/)

    const figure = await sbx.runCode(
      'import matplotlib.pyplot as plt\nplt.plot([0, 1], [1, 3], label="l")\nplt.title("js")\nplt.show()',
    )
    const [result] = figure.results
    assert.ok(Buffer.from(result.png, 'base64').subarray(0, 4).equals(Buffer.from([0x89, 0x50, 0x4e, 0x47])))
    assert.equal(result.chart.type, 'line')
    assert.equal(result.chart.title, 'js')
    assert.deepEqual(result.chart.elements[0].points, [[0, 1], [1, 3]])

    const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
    assert.equal(ctx.cwd, '/tmp')
    const isolated = await sbx.runCode('x', { context: ctx })
    assert.equal(isolated.error.name, 'NameError')
    assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
    await sbx.removeCodeContext(ctx)
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))

    const env = await sbx.runCode('import os; os.environ["JS_ENV"]', { envs: { JS_ENV: 'yes' } })
    assert.equal(env.text, "'yes'")
  } finally {
    await sbx.kill()
  }
})
